"""The README's Python examples run as written (docs that drift from the code fail here)."""

import re
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run(capsys):
    first, *rest = python_blocks()
    assert rest, "the README lost its prepared-list example"
    # The later examples continue inside the first one's `with` block.
    body = first + "".join(textwrap.indent(block, "    ") for block in rest)
    exec(compile(body, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "Path(transport='shm'" in out
    assert "('initiator', b'layer-0')" in out
