"""Every Python snippet of the README and the documentation runs: conftest snippets are collected by
`pytest --qreport`, test snippets run under pytest, and the rest run as scripts, each page's snippets in one
namespace. The names a snippet leaves to the reader (a model, its batches) come from the preambles below."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# what a conftest or test snippet may use without defining it
CONFTEST_PREAMBLE = f'''
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, {str(ROOT / "examples")!r})
from models import VOCABULARY, TinyEncoder, WordTokenizer, sentences  # noqa: E402

from pytest_qreport import qmodel  # noqa: E402


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(8, 10)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.encoder(x))


def load_classifier():
    return Classifier().eval()


def label(x):
    return load_classifier()(x).argmax(-1)


def accuracy(model, batches):
    return sum(int((model(x).argmax(-1) == label(x)).sum()) for x in batches) / sum(len(x) for x in batches)


def _batches(seed, count=4):
    """Inputs of 16 well-separated classes (one strong feature each), as a trained classifier sees them."""
    g = torch.Generator().manual_seed(seed)
    classes = [torch.randint(0, 16, (16,), generator=g) for _ in range(count)]
    return [torch.nn.functional.one_hot(c, 16).float() * 6 + 0.3 * torch.randn(16, 16, generator=g) for c in classes]


@pytest.fixture
def calibration_batches():
    return _batches(0)


@pytest.fixture
def held_out():
    return _batches(1)


@pytest.fixture
def trained_model():
    return load_classifier()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """A float tiny Llama and its W4A16 compressed-tensors checkpoint, saved as llm-compressor saves one."""
    sys.path.insert(0, {str(ROOT)!r})
    from tests.helpers import compressed_tensors_checkpoint, tiny_llama

    directory = tmp_path_factory.mktemp("checkpoints")
    reference = tiny_llama()
    reference.save_pretrained(directory / "llama")
    compressed_tensors_checkpoint(reference, directory / "llama-w4a16", "W4A16", group_size=32)
    return directory


@pytest.fixture(scope="session")
def token_batches():
    g = torch.Generator().manual_seed(0)
    return [{{"input_ids": torch.randint(0, 128, (2, 16), generator=g)}} for _ in range(4)]
'''

# what a script snippet may use without defining it
SCRIPT_PREAMBLE = '''
import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


model = Mlp().eval()
_g = torch.Generator().manual_seed(0)
batches = [torch.randn(16, 32, generator=_g) for _ in range(4)]
batch = example_inputs = batches[0]
calibration = calibration_batches = batches
linear = nn.Linear(64, 64)
'''


def snippets(page):
    """The Python snippets of one page, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def kind(code):
    """'conftest', 'test' or 'script'."""
    if re.search(r"qmodel\(|def pytest_qreport_|@pytest\.fixture|^import pytest", code, re.M):
        return "conftest"
    return "test" if re.search(r"^def test_", code, re.M) else "script"


PAGES_WITH_SNIPPETS = [page for page in PAGES if snippets(page)]


def test_every_page_is_checked_and_the_readme_has_a_runnable_example():
    assert ROOT / "README.md" in PAGES_WITH_SNIPPETS
    assert len(PAGES_WITH_SNIPPETS) >= 6


class _Run:
    """What a snippet's pytest run gave: its exit code and output."""

    def __init__(self, result):
        self.returncode, self.stdout, self.stderr = int(result.ret), result.stdout.str(), result.stderr.str()


@pytest.mark.parametrize("page", PAGES_WITH_SNIPPETS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_snippets_of_a_page_run(page, pytester, monkeypatch):
    tmp_path = pytester.path

    def _pytest(directory, *args):
        """pytest in `directory`, in a forked child of this process (tests/forked.py)."""
        monkeypatch.chdir(directory)
        return _Run(pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", *args))

    namespace: dict = {}
    exec(compile(SCRIPT_PREAMBLE, "preamble", "exec"), namespace)
    for index, code in enumerate(snippets(page)):
        where = f"{page.relative_to(ROOT)}, snippet {index + 1}"
        if kind(code) == "script":
            exec(compile(code, where, "exec"), namespace)
            continue
        directory = tmp_path / f"snippet{index}"
        directory.mkdir()
        if kind(code) == "conftest":
            (directory / "conftest.py").write_text(CONFTEST_PREAMBLE + "\n" + code)
            result = _pytest(directory, "--qreport", "--collect-only", "-q")
            assert result.returncode in (0, 5), f"{where}:\n{result.stdout}\n{result.stderr}"
            assert "error" not in result.stdout.lower(), f"{where}:\n{result.stdout}"
            if "qmodel(" in code:
                assert "tests collected" in result.stdout or "test collected" in result.stdout, result.stdout
        else:
            (directory / "conftest.py").write_text(CONFTEST_PREAMBLE)
            (directory / "test_snippet.py").write_text("from conftest import accuracy, label  # noqa: F401\n" + code)
            _pytest(directory, "--qreport-update-baseline")  # a snippet's assert_baseline() needs a baseline
            result = _pytest(directory)
            assert result.returncode == 0, f"{where}:\n{result.stdout}\n{result.stderr}"
