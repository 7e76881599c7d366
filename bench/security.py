"""`make test-security`'s report: the attack tests' JUnit XML (pytest -m security tests/security) →
bench/results/security.json with ``attacks_tried`` (security items that ran) and ``attacks_accepted`` (items that
failed or errored: an attack the system let through; must be 0), per file, and the names of any accepted."""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path


def report(junit: Path) -> dict:
    root = ET.parse(junit).getroot()
    tried: Counter[str] = Counter()
    accepted: list[str] = []
    skipped = 0
    for case in root.iter("testcase"):
        if case.find("skipped") is not None:
            skipped += 1
            continue
        module = case.get("classname", "").rsplit(".", 1)[-1]
        tried[module] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            accepted.append(f"{case.get('classname')}::{case.get('name')}")
    return {"attacks_tried": sum(tried.values()), "attacks_accepted": len(accepted), "skipped": skipped,
            "by_file": dict(sorted(tried.items())), "accepted": accepted,
            "command": "pytest -m security tests/security", "at": datetime.now(UTC).isoformat(timespec="seconds")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("junit", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench/results/security.json"))
    args = parser.parse_args()
    doc = report(args.junit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"security: {doc['attacks_tried']} attacks tried, {doc['attacks_accepted']} accepted → {args.out}")
    return 0 if doc["attacks_tried"] > 0 and doc["attacks_accepted"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
