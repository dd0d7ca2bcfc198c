"""MkDocs hook: adds the generated reference pages (docs/generate) to the site as virtual files, written from the
code on every build; none of them is ever a file in docs/."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # docs.generate, beside the packages of a source checkout
    sys.path.insert(0, str(ROOT))

from docs.generate import PAGES  # noqa: E402


def on_files(files, config):
    for src_uri, write in PAGES.items():
        if files.get_file_from_path(src_uri) is not None:
            raise PluginError(f"docs/{src_uri} is generated (docs/generate): delete the file, edit its sources instead")
        files.append(File.generated(config, src_uri, content=write()))
    return files
