"""Chapter 25: the tuning database. Plan a small model twice against one database: the
first run times every raced site and writes the times back; the second, as a new
process would, finds them all and times nothing.

    python examples/ch25_tuning.py [zoo:resnet]
"""

import sys
import tempfile
import time
from pathlib import Path

from opswap.bench.timing import with_timer
from opswap.graph.capture import capture
from opswap.models import load
from opswap.planner import make_plan
from opswap.targets import get_target
from opswap.tuning import TunedTimer, TuningDB


def main(spec: str) -> None:
    loaded = load(spec, {"width": "4", "image_size": "16", "batch": "2"})
    db = Path(tempfile.mkdtemp()) / "tuning.sqlite"  # your runs use ~/.cache/opswap/
    for run in ("first", "second"):
        target = with_timer(get_target("cpu"), str(db))  # a new timer: a new run
        timer = target.timer
        assert isinstance(timer, TunedTimer)
        captured = capture(loaded.module, loaded.example_inputs)
        t0 = time.perf_counter()
        plan = make_plan(captured, target=target, rules="conv.algorithm", exactness="approx")
        s = timer.summary()
        print(
            f"{run} run: {s['timings_made']} site timings made, {s['hits']} hits, "
            f"{s['misses']} misses, {s['near']} near; planned in "
            f"{time.perf_counter() - t0:.2f} s; {len(plan.decisions)} conv(s) changed algorithm"
        )
        for site in s["sites"]:
            print(f"  {site['key']:<30} {site['outcome']}")
    print(f"database: {db}, {len(TuningDB(db))} records")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "zoo:resnet")
