"""One child pytest for the session's interpreter runs of the kernel tests.

Triton picks its interpreter when first imported, so a file's `@in_interpreter` tests run in
a child pytest started with TRITON_INTERPRET=1, asked for by the file's parent test
`test_*_under_the_interpreter` (test_triton_kernels.py says more). A child spends seconds
importing torch, Triton and the test modules: the files of every parent test this session
selected that takes the `interpreter` fixture run in one child (test_triton_kernels.py's
InterpreterRun), started when the first of them asks; each parent test then checks its own
file's outcomes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from test_triton_kernels import InterpreterRun


@pytest.fixture(scope="session")
def interpreter(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> InterpreterRun:
    """The child run of the files whose parent tests this session selected."""
    from test_triton_kernels import InterpreterRun

    files = sorted({item.path.resolve() for item in request.session.items
                    if "interpreter" in getattr(item, "fixturenames", ())})
    return InterpreterRun(files, tmp_path_factory.mktemp("interpreter") / "report.xml")
