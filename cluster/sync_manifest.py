"""Keep ``spec.serveConfigV2`` of cluster/rayservice.yaml equal to serve_config.yaml.

``python -m cluster.sync_manifest`` rewrites the embedded block from serve_config.yaml (the
rest of the manifest, comments included, is left byte for byte); ``--check`` changes nothing and
exits 1 with a diff when the two differ (for CI and ``make lint``).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIG = ROOT / "serve_config.yaml"
MANIFEST = ROOT / "cluster" / "rayservice.yaml"

_KEY = re.compile(r"^(?P<indent> *)serveConfigV2: *\|[-+]?\s*$")


class ManifestError(ValueError):
    """The manifest or the serve config can't be synced (no block, unparsable YAML…)."""


def _block_span(lines: list[str]) -> tuple[int, int, str]:
    """(index of the `serveConfigV2: |` line, end of its block, the block's indentation)."""
    for index, line in enumerate(lines):
        match = _KEY.match(line)
        if match is None:
            continue
        key_indent = len(match.group("indent"))
        end = index + 1
        while end < len(lines):
            text = lines[end]
            if text.strip() and len(text) - len(text.lstrip(" ")) <= key_indent:
                break
            end += 1
        # Trailing blank lines belong to what follows the block, not to the config.
        while end > index + 1 and not lines[end - 1].strip():
            end -= 1
        return index, end, " " * (key_indent + 2)
    raise ManifestError("no `serveConfigV2: |` block found")


def render(manifest_text: str, serve_config_text: str) -> str:
    """The manifest with its serveConfigV2 block replaced by ``serve_config_text``."""
    config = yaml.safe_load(serve_config_text)
    if not isinstance(config, dict) or not config.get("applications"):
        raise ManifestError("serve config has no `applications:` list")
    first = next((line for line in serve_config_text.splitlines() if line.strip()), "")
    if first.startswith((" ", "\t")):
        raise ManifestError("serve config must start at column 0 to embed as a `|` block")
    lines = manifest_text.splitlines(keepends=True)
    start, end, indent = _block_span(lines)
    body = [
        f"{indent}{line}\n" if line.strip() else "\n"
        for line in serve_config_text.rstrip("\n").splitlines()
    ]
    rendered = "".join([*lines[: start + 1], *body, *lines[end:]])
    if embedded_config(rendered) != config:  # Never write something that parses differently.
        raise ManifestError("the rendered serveConfigV2 does not parse back to serve_config.yaml")
    return rendered


def rayservice(manifest_text: str) -> dict[str, object]:
    """The RayService document of a (possibly multi-document) manifest."""
    for document in yaml.safe_load_all(manifest_text):
        if isinstance(document, dict) and document.get("kind") == "RayService":
            return document
    raise ManifestError("no `kind: RayService` document")


def embedded_config(manifest_text: str) -> object:
    spec = rayservice(manifest_text).get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("serveConfigV2"), str):
        raise ManifestError("spec.serveConfigV2 is missing or not a string")
    return yaml.safe_load(spec["serveConfigV2"])


def _show(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if out of sync; write nothing")
    parser.add_argument("--serve-config", type=Path, default=SERVE_CONFIG)
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    args = parser.parse_args(argv)
    current = args.manifest.read_text()
    manifest, source = _show(args.manifest), _show(args.serve_config)
    try:
        wanted = render(current, args.serve_config.read_text())
    except (ManifestError, yaml.YAMLError) as exc:
        print(f"{manifest}: {exc}", file=sys.stderr)
        return 2
    if wanted == current:
        print(f"{manifest}: serveConfigV2 matches {source}")
        return 0
    if args.check:
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            wanted.splitlines(keepends=True),
            f"{manifest} (now)",
            f"{manifest} (from {source})",
        )
        sys.stderr.writelines(diff)
        print(
            f"{manifest}: serveConfigV2 differs from {source}; "
            "run `python -m cluster.sync_manifest`",
            file=sys.stderr,
        )
        return 1
    args.manifest.write_text(wanted)
    print(f"{manifest}: serveConfigV2 rewritten from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
