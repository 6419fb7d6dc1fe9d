"""Record the float32 state's drift over a million tokens (chapter 10): :func:`lightning_edu.drift.state_drift` for
every distribution, decay (1 and 0.999), input dtype, update and state.

    python -m benchmarks.drift OUT.json [TOKENS]       # TOKENS defaults to 2**20
"""

from __future__ import annotations

import sys
import time

from lightning_edu.drift import DISTRIBUTIONS, STATES, UPDATES, state_drift


def main(argv=None) -> int:
    from lightning_edu.environment import environment_record, save_record

    from .common import usage_refused

    argv = sys.argv[1:] if argv is None else argv
    refused = usage_refused(argv, __doc__, counts=(1, 2))
    if refused is not None:
        return refused
    path = argv[0]
    n = int(argv[1]) if len(argv) == 2 else 1 << 20
    record = {**environment_record("python -m benchmarks.drift " + " ".join(argv), device="cpu"),
              "results": []}
    start = time.time()
    for distribution in DISTRIBUTIONS:
        for decay in (1.0, 0.999):
            for inputs in ("float32", "bfloat16"):
                for update in UPDATES:
                    for state in STATES:
                        run = state_drift(n, decay, inputs=inputs, state=state, update=update,
                                          distribution=distribution)
                        record["results"].append(run)
                        print(f"{time.time() - start:5.0f}s {distribution} decay={decay} {inputs} {update} {state}: "
                              f"final state error {run['state_error'][-1]:.2g} ({run['seconds']:.1f} s)", flush=True)
                        save_record(path, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
