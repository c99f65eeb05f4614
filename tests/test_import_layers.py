"""hylo's imports keep the layer order `hylo`'s docstring states (measured by
`benchmarks/import_graph.py`): every folder and top-level module has its layer, no import runs from a
lower layer up to a higher one, and no modules (nor units) import each other in a circle."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import import_graph

SRC = Path(__file__).resolve().parents[1] / "src"


def test_imports_go_down_the_layer_order_without_circles():
    found = import_graph.measure(SRC, import_graph.layer_order(SRC))
    assert found["unplaced"] == []
    assert found["upward_imports"] == []
    assert found["module_circles"] == [] and found["unit_circles"] == []


def test_a_circle_and_an_upward_import_are_found(tmp_path):
    """An import inside a function counts; `from package import module` is an import of the module."""
    package = tmp_path / "hylo"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text('"""x\n\nLayers, top to bottom:\n\n    top\n    low\n"""\n')
    (package / "top.py").write_text("import hylo.low.a\n")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from hylo.low import b\n")
    (package / "low" / "b.py").write_text("from hylo.low.a import f\nfrom hylo import top\n")
    found = import_graph.measure(tmp_path, import_graph.layer_order(tmp_path))
    assert found["module_circles"] == [["hylo.low.a", "hylo.low.b", "hylo.top"]]
    assert found["unit_circles"] == [["low", "top"]]
    assert found["upward_imports"] == ["low -> top: hylo/low/b.py:2 imports hylo.top"]
