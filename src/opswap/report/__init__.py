"""Reports of an optimize run: report.md and report.html (plots embedded)."""

from opswap.report.optimize_report import build_report, write_reports

__all__ = ["build_report", "write_reports"]
