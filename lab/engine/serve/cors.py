"""Cross-origin requests, as vLLM's server allows them: `--allowed-origins`, `--allowed-methods`,
`--allowed-headers` (JSON lists, default `["*"]`) and `--allow-credentials`, applied by Starlette's
CORSMiddleware, so a page served from another origin (a browser playground, a dashboard) can call
the API with `fetch`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (`'["https://a.example", "https://b.example"]'`), as vLLM takes them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}: "
                                         f"{exc.msg}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


@dataclass(frozen=True)
class CorsPolicy:
    origins: list[str] = field(default_factory=lambda: ["*"])
    methods: list[str] = field(default_factory=lambda: ["*"])
    headers: list[str] = field(default_factory=lambda: ["*"])
    credentials: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cross-origin requests (CORS), as vLLM's flags")
    group.add_argument("--allowed-origins", type=json_list, default=["*"], metavar="JSON",
                       help='origins allowed to call the API, a JSON list [default: ["*"]]')
    group.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
                       help='HTTP methods allowed cross-origin, a JSON list [default: ["*"]]')
    group.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
                       help='request headers allowed cross-origin, a JSON list [default: ["*"]]')
    group.add_argument("--allow-credentials", action="store_true",
                       help="allow credentials (cookies, Authorization) on cross-origin requests")


def from_namespace(ns: argparse.Namespace) -> CorsPolicy:
    return CorsPolicy(ns.allowed_origins, ns.allowed_methods, ns.allowed_headers, ns.allow_credentials)
