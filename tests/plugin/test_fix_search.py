"""The fix search is one place: a check hands its model to `pytest_qreport.fixes` once, gets its fixes back, and
prints them; the model walks into no other module of the plugin on the way (the modules a call passes the model
to, in order, are the walk's rooms)."""
import math
import sys

from pytest_qreport.checks import BUILTIN_CHECKS
from pytest_qreport.core.registry import ModelContext
from tests.helpers import analyze_with_checks
from tests.plugin.test_advice import _features, wide_rows

# the model's own methods and Check.finding, which makes a finding of a value: not a room of the fix's walk
OWN = "pytest_qreport.core.registry"


def _measuring(frame):
    """Whether the call is a measurement's callback (a detector's screen, run by qcore's comparison pass when a
    check first reads the model's SQNR): the verdict pass, not the walk to a fix."""
    frame = frame.f_back
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("qcore"):
            return True
        if frame.f_code.co_name == "findings":
            return False
        frame = frame.f_back
    return False


def _walks(monkeypatch):
    """{check name: [the rooms of each findings call's walk]}, recorded while the checks run."""
    walks: dict[str, list[list[str]]] = {}

    def traced(check_class):
        original = check_class.findings

        def findings(self, model, layers):
            if not isinstance(model, ModelContext):
                return original(self, model, layers)
            rooms: list[str] = []

            def profile(frame, event, arg):
                if event != "call":
                    return
                module = frame.f_globals.get("__name__", "")
                if not module.startswith("pytest_qreport") or module == OWN:
                    return
                arguments = frame.f_code.co_varnames[:frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
                if any(frame.f_locals.get(name) is model for name in arguments) and not _measuring(frame):
                    room = "pytest_qreport.fixes" if module.startswith("pytest_qreport.fixes") else module
                    if not rooms or rooms[-1] != room:
                        rooms.append(room)

            sys.setprofile(profile)
            try:
                return original(self, model, layers)
            finally:
                sys.setprofile(None)
                walks.setdefault(self.name, []).append(rooms)

        monkeypatch.setattr(check_class, "findings", findings)

    owners = {next(k for k in check_class.__mro__ if "findings" in vars(k)) for check_class in BUILTIN_CHECKS}
    for owner in owners:
        traced(owner)
    return walks


def test_every_check_walks_its_model_into_the_fix_search_once_and_into_no_other_room(monkeypatch):
    walks = _walks(monkeypatch)
    found, _ = analyze_with_checks(
        wide_rows, _features(), quantizer="int8_per_tensor", sqnr_min_db=45, weight_sqnr_min_db=45,
        model_sqnr_min_db=60, fix_budget=math.inf,
        checks=["sqnr", "weight_sqnr", "model_sqnr", "sensitivity", "per_channel", "outlier", "equalization",
                "input_weight_equalization"])
    sqnr = found[("sqnr", "layers.2")]
    assert sqnr.verdict == "fail" and "Measured fixes:" in sqnr.message, sqnr.message
    assert "was measured to reach" in found[("model_sqnr", "output")].message or \
        "was measured at" in found[("model_sqnr", "output")].message
    assert walks["sqnr"] == [["pytest_qreport.checks.sqnr", "pytest_qreport.fixes", "pytest_qreport.checks.sqnr"]]
    for name, calls in walks.items():
        for rooms in calls:
            own = [room for room in rooms if room != "pytest_qreport.fixes"]
            assert rooms.count("pytest_qreport.fixes") <= 1 and len(set(own)) <= 1, (name, rooms)
    asked = {name for name, calls in walks.items() if any("pytest_qreport.fixes" in rooms for rooms in calls)}
    assert {"sqnr", "weight_sqnr", "model_sqnr", "sensitivity", "per_channel"} <= asked, walks



def test_the_guides_custom_check_prints_the_fixes_the_fix_search_measured():
    import pathlib
    import re

    from pytest_qreport.checks import BUILTIN_CHECKS as BUILTIN
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.quantizers import model_quantizer
    from pytest_qreport.core.settings import ModelSettings
    from tests.helpers import PluginHook, builtin_registry

    guide = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide" / "extending.md").read_text()
    source = next(block for block in re.findall(r"```python\n(.*?)```", guide, re.S) if "fix_search" in block)
    namespace: dict = {}
    exec(source, namespace)  # the guide's example, as written there
    check_class = namespace["WorstLayers"]
    registry = builtin_registry()
    registry.register(check_class)
    batches = _features()
    settings = ModelSettings.defaults((*BUILTIN, check_class), calibration=batches, quantizer="int8_per_tensor",
                                      checks=["sqnr", "worst_layers"], sqnr_min_db=45, layers=["layers.2"],
                                      fix_budget=math.inf, check_options={"worst_layers": {"min_db": 45.0}})
    pipeline = collect_model("m", settings, registry, model_quantizer(settings, PluginHook()), wide_rows(), batches[0])
    pipeline.analyze(lambda: batches, lambda found: None)
    assert pipeline.findings is not None, pipeline.error
    mine, sqnr = pipeline.findings[("worst_layers", "layers.2")], pipeline.findings[("sqnr", "layers.2")]
    assert mine.verdict == "fail" and "per-channel weights (measured with the fix:" in mine.message, mine.message
    printed = mine.message.split("Measured fixes: ", 1)[1]
    assert printed in sqnr.message  # the same fixes, measured once, that the sqnr item prints


def test_in_artifact_mode_the_checks_walk_their_model_into_the_artifacts_fix_search_once(monkeypatch):
    import copy

    from torchao.quantization import Int8WeightOnlyConfig

    from pytest_qreport.checks import BUILTIN_CHECKS as BUILTIN
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.settings import ModelSettings
    from pytest_qreport.fixes import ArtifactFixSearch, fix_search
    from tests.helpers import builtin_registry, torchao_artifact

    walks = _walks(monkeypatch)
    reference, batches = wide_rows(), _features()
    quantized = torchao_artifact(copy.deepcopy(reference), Int8WeightOnlyConfig())
    settings = ModelSettings.defaults(BUILTIN, calibration=batches, quantized=lambda: quantized,
                                      checks=["sqnr", "weight_sqnr", "model_sqnr"], sqnr_min_db=60,
                                      weight_sqnr_min_db=60, model_sqnr_min_db=60, fix_budget=math.inf)
    pipeline = collect_model("m", settings, builtin_registry(), None, reference, batches[0], quantized=quantized)
    pipeline.analyze(lambda: batches, lambda found: None)
    assert pipeline.findings is not None, pipeline.error
    assert isinstance(fix_search(pipeline.context), ArtifactFixSearch)
    output = pipeline.findings[("model_sqnr", "output")]
    assert output.verdict == "fail" and "swaps the reference's modules in" in output.message, output.message
    assert walks["model_sqnr"] == [["pytest_qreport.checks.sqnr", "pytest_qreport.fixes",
                                    "pytest_qreport.checks.sqnr"]]
    for name, calls in walks.items():
        for rooms in calls:
            assert rooms.count("pytest_qreport.fixes") <= 1 and \
                len({room for room in rooms if room != "pytest_qreport.fixes"}) <= 1, (name, rooms)


def test_an_output_fix_says_in_fields_what_its_text_prints_and_unpacks_as_the_text_and_recipe_pair(monkeypatch):
    from pytest_qreport.checks import BUILTIN_CHECKS as BUILTIN
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.quantizers import model_quantizer
    from pytest_qreport.core.settings import ModelSettings
    from pytest_qreport.fixes import SimulationFixSearch
    from tests.helpers import PluginHook, builtin_registry

    answered = []
    original = SimulationFixSearch.output_fix

    def recorded(self, *args, **kwargs):
        answered.append(original(self, *args, **kwargs))
        return answered[-1]

    monkeypatch.setattr(SimulationFixSearch, "output_fix", recorded)
    batches, answers = _features(), {}
    for budget in (0, math.inf):
        settings = ModelSettings.defaults(BUILTIN, calibration=batches, quantizer="int8_per_tensor",
                                          checks=["model_sqnr"], model_sqnr_min_db=60.0, fix_budget=budget)
        pipeline = collect_model("m", settings, builtin_registry(), model_quantizer(settings, PluginHook()),
                                 wide_rows(), batches[0])
        pipeline.analyze(lambda: batches, lambda found: None)
        assert pipeline.findings is not None, pipeline.error
        answers[budget] = answered[-1]  # the model_sqnr item's, as it printed it
        assert answers[budget].text in pipeline.findings[("model_sqnr", "output")].message
    spent, searched = answers[0], answers[math.inf]
    assert spent.unsearched and not spent.setting and "fix_budget is 0" in spent.text
    assert searched.setting == "float_layers" and "float_layers=[" in searched.text and not searched.unsearched
    text, recipe = searched  # a check written against the (text, recipe) pair it answered before
    assert (text, recipe) == (searched.text, searched.recipe) and searched[0] == text
