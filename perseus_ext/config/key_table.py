"""The key table of README.md and docs/deepspeed.md, generated from `PerseusConfig` (a test
keeps both files equal to it): one row per key with its rule, its default and its description,
so the documentation cannot drift from what the door accepts.

Regenerate after changing a key: `python -m perseus_ext.config.key_table` prints the table.
"""

from __future__ import annotations

import json

from perseus_ext.config.perseus import PerseusConfig
from perseus_ext.config.rules import field_rule


def _type_and_default(name: str) -> str:
    info = PerseusConfig.model_fields[name]
    kind = field_rule(PerseusConfig, name).requirement.replace("|", "\\|")
    if info.default is None and not kind.startswith("null"):
        kind += " \\| null"
    return f"{kind}, `{json.dumps(info.get_default(call_default_factory=True))}`"


def key_table_markdown() -> str:
    """The markdown table: `| key | type / default | meaning |`."""
    rows = ["| key | type / default | meaning |", "|---|---|---|"]
    rows += [
        f"| `{name}` | {_type_and_default(name)} | {info.description} |"
        for name, info in PerseusConfig.model_fields.items()
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    print(key_table_markdown())
