"""Print the configuration tables of docs/configuration.md from the code that parses the settings.

The device plugin and the node-health processes declare every setting once (``OPTIONS`` in
``device_plugin/config.py`` and ``npd/config.py``); the extender declares its flags in
``scheduler_extender/cmd/extender.py`` (``build_parser``). This script renders them as Markdown tables between
``<!-- BEGIN GENERATED: <name> -->`` / ``<!-- END GENERATED: <name> -->`` markers, so the documentation cannot
drift from the code: ``tests/test_docs.py`` compares the blocks in docs/configuration.md with this output.

    python scripts/gen_config_docs.py                 # print every block
    python scripts/gen_config_docs.py --write FILE    # replace the blocks in FILE in place
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from device_plugin import config as dp_config
from inference.gateway import main as gw_main
from inference.operator import main as io_main
from npd import config as npd_config
from scheduler_extender.cmd import controller as ctl_main
from scheduler_extender.cmd import extender as ext_main
from scheduler_extender.cmd import hub as hub_main
from scheduler_extender.cmd import member_agent as agent_main

MARKER = re.compile(r"<!-- BEGIN GENERATED: (?P<name>[a-z0-9-]+) -->\n.*?<!-- END GENERATED: (?P=name) -->",
                    re.DOTALL)


def _closure(fn: Callable[..., Any]) -> dict[str, Any]:
    names = fn.__code__.co_freevars
    cells = fn.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(names, cells, strict=True)}


def describe_type(parse: Callable[..., Any]) -> str:
    """A short human name for a value parser of the config tables."""
    qual = getattr(parse, "__qualname__", "")
    outer = qual.split(".<locals>", 1)[0]
    if outer == "parse_int":
        c = _closure(parse)
        if c.get("maximum") is not None:
            return f"integer {c['minimum']} to {c['maximum']}"
        return f"integer ≥ {c['minimum']}"
    if outer == "parse_float":
        return f"number ≥ {_closure(parse)['minimum']:g}"
    if outer == "parse_choice":
        return " | ".join(_closure(parse)["choices"])
    if outer == "parse_list":
        return f"list of {describe_type(_closure(parse)['item'])}"
    return {
        "parse_bool": "bool",
        "parse_duration": "duration",
        "parse_str": "string",
        "parse_address": "host:port",
        "parse_resource_name": "resource name",
        "parse_hex_id": "PCI ID (hex)",
        "parse_argv": "command",
        "parse_signed_int": "integer ≥ -1",
        "parse_condition_resource": "Condition=resource",
        "parse_kubeconfig": "file path",
    }.get(outer, outer)


def _duration(seconds: float) -> str:
    if seconds == 0:
        return "0"
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and float(seconds / size).is_integer():
            return f"{int(seconds // size)}{unit}"
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def describe_default(option: Any) -> str:
    value = option.default
    if getattr(option.parse, "__qualname__", "") == "parse_duration":
        return f"`{_duration(float(value))}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(str(v) for v in value) + "]`" if value else "`[]`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped, angle brackets as entities (renderers drop unknown tags)."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def options_table(options: Iterable[Any]) -> str:
    rows = ["| file key | flag | environment variable | type | default | meaning |",
            "|---|---|---|---|---|---|"]
    for o in options:
        rows.append(f"| `{o.key}` | `{o.flag_name}` | `{o.env_name}` | {_cell(describe_type(o.parse))} | "
                    f"{_cell(describe_default(o))} | {_cell(o.help)} |")
    return "\n".join(rows)


def extender_table(module: Any = ext_main) -> str:
    parser = module.build_parser({})  # an empty environment: the built-in defaults
    rows = ["| flag | environment variable | default | meaning |", "|---|---|---|---|"]
    for action in parser._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if not long or long[0] == "--help":
            continue
        flag = long[0]
        env = module.ENV + flag[2:].upper().replace("-", "_")
        meaning = (action.help or "").split(" [env ", 1)[0]
        default = action.default if action.default not in ("", None) else '""'
        rows.append(f"| `{flag}` | `{env}` | `{default}` | {_cell(meaning)} |")
    return "\n".join(rows)


def blocks() -> dict[str, str]:
    return {
        "device-plugin": options_table(dp_config.OPTIONS),
        "extender": extender_table(),
        "controller": extender_table(ctl_main),
        "npd": options_table(npd_config.OPTIONS),
        "gateway": extender_table(gw_main),
        "inference-operator": extender_table(io_main),
        "hub": extender_table(hub_main),
        "member-agent": extender_table(agent_main),
    }


def render(name: str, body: str) -> str:
    return f"<!-- BEGIN GENERATED: {name} -->\n{body}\n<!-- END GENERATED: {name} -->"


def found_blocks(text: str) -> dict[str, str]:
    """The generated blocks of a document, by name, markers included."""
    return {m.group("name"): m.group(0) for m in MARKER.finditer(text)}


def rewrite(text: str) -> str:
    generated = blocks()
    return MARKER.sub(lambda m: render(m.group("name"), generated[m.group("name")]), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--write", metavar="FILE", help="replace the generated blocks in FILE in place")
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(rewrite(path.read_text()))
        return 0
    for name, body in blocks().items():
        print(render(name, body))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
