"""The tuning database and the learned cost model (chapter 25).

`TuningDB` (db.py) keeps every site timing opswap makes in one SQLite file, keyed by
the op's signature, shapes, dtype, layout, device and versions (keys.py); `tuned`
(timer.py) is the timer that looks a timing up before making it; `CostModel`
(costmodel.py) ranks a site's candidates from roofline and shape features
(features.py) so that only the promising ones are timed.
"""

from opswap.tuning.db import (
    NEAR_DISTANCE,
    Key,
    Record,
    TuningDB,
    TuningDBWarning,
    default_path,
    resolve_path,
    shape_distance,
)
from opswap.tuning.timer import (
    Measured,
    SiteTuning,
    TunedTimer,
    site_scope,
    timings_made,
    tuned,
)

__all__ = [
    "NEAR_DISTANCE",
    "Key",
    "Measured",
    "Record",
    "SiteTuning",
    "TuningDB",
    "TunedTimer",
    "TuningDBWarning",
    "default_path",
    "resolve_path",
    "shape_distance",
    "site_scope",
    "timings_made",
    "tuned",
]
