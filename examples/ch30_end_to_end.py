"""Chapter 30: the whole flow on a Hugging Face model (random weights from a
config): analyze, plan, apply, verify, bench, report.

    python examples/ch30_end_to_end.py [hf:bert] [OUT_DIR]
"""

import sys
import tempfile

from opswap.config import OptimizeConfig
from opswap.models import load
from opswap.pipeline import optimize


def main(spec: str, out_dir: str) -> None:
    loaded = load(spec)
    result = optimize(
        loaded.module,
        loaded.example_inputs,
        OptimizeConfig(target="cpu", budget="cosine>=0.99999"),
        name=spec,
    )
    data = result.to_json()
    print(
        f"{spec}: {len(data['applied'])} replacements by "
        f"{sorted({a['rule'] for a in data['applied']})}"
    )
    print("verification:", {k: data["verification"][k] for k in ("passed", "cosine", "max_abs")})
    print("benchmark:", data["benchmark"])
    print("wrote", result.save(out_dir)["report_html"])


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "hf:bert",
        sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="opswap-ch30-"),
    )
