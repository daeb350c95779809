"""The connector fits every supported vLLM, checked against each version's own source
(cluster/vllm_sources.py fetches them; nothing of theirs is imported): each name
transfer/vllm_compat.py lists exists where it says, each VllmApi flag is what the source
shows, and PdcConnector implements each version's abstract hooks with signatures its
callers can use. The checker itself is shown to fail on a broken copy of a base class."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_source_ast import Params, Source, fetched, incompatibility, own_methods

from pdcluster.transfer.vllm_compat import API, CONNECTOR_BASE, SUPPORTED, USES, VllmApi, check_supported

CONNECTOR = Path(__file__).resolve().parents[1] / "transfer" / "connector.py"
CONNECTOR_META = CONNECTOR.with_name("connector_meta.py")
# The project's classes (and their files), and the vLLM classes whose hooks each must implement.
IMPLEMENTS = {"PdcConnector": (CONNECTOR, ("KVConnectorBase_V1", "SupportsHMA")),
              "PullTimings": (CONNECTOR_META, ("KVConnectorWorkerMetadata",))}
# Each VllmApi flag, and the name in the source that decides it.
FLAG_SYMBOLS = {
    "transfer_results": (CONNECTOR_BASE, "KVConnectorTransferResults"),
    "block_state": ("vllm.v1.core.sched.output", "SchedulerOutput.kv_connector_block_state"),
    "failed_recving": ("vllm.v1.outputs", "KVConnectorOutput.failed_recving"),
    "sleep_mode_hook": (CONNECTOR_BASE, "KVConnectorBase_V1.supports_sleep_mode"),
}


def source_of(version: str) -> Source:
    return Source(fetched(f"vllm-{version}"))


@pytest.fixture(params=SUPPORTED)
def version(request) -> str:
    return request.param


def missing_symbols(src: Source, version: str) -> list[str]:
    out = []
    for sym in USES:
        if not sym.in_version(version):
            continue
        node = src.defines(sym.module, sym.name)
        if node is None:
            out.append(f"{sym.module}.{sym.name}")
        elif sym.params is not None:
            have = set(Params.of(node).positional) | set(Params.of(node).keyword_only)
            if lacking := [p for p in sym.params if p not in have]:
                out.append(f"{sym.module}.{sym.name} takes no {lacking}")
    return out


def unimplemented_hooks(src: Source) -> list[str]:
    """Each abstract method of the vLLM bases not implemented, or implemented with a signature
    vLLM cannot call; and each override of a base method vLLM would call wrongly."""
    out = []
    for ours, (path, bases) in IMPLEMENTS.items():
        mine = own_methods(path, ours)
        for base in bases:
            assert src.find_class(CONNECTOR_BASE, base), f"{base} is not in this version's {CONNECTOR_BASE}"
            for name, params in src.abstract_methods(CONNECTOR_BASE, base).items():
                if name not in mine:
                    out.append(f"{ours} does not implement {base}.{name}")
            for name, params in src.methods(CONNECTOR_BASE, base).items():
                if name in mine and name != "__init__" and (why := incompatibility(params, mine[name])):
                    out.append(f"{ours}.{name} vs {base}.{name}: {why}")
    return out


def test_every_vllm_name_the_project_uses_is_in_each_version_it_is_listed_for(version):
    assert missing_symbols(source_of(version), version) == []


def test_each_versions_api_flags_are_what_its_source_shows(version):
    src = source_of(version)
    shown = {flag: src.defines(module, name) is not None for flag, (module, name) in FLAG_SYMBOLS.items()}
    api = API[version]
    assert {flag: getattr(api, flag) for flag in FLAG_SYMBOLS} == shown
    assert set(FLAG_SYMBOLS) == set(VllmApi.__dataclass_fields__) - {"version"}, "a flag with no source check"


def test_the_connector_implements_each_versions_hooks_with_callable_signatures(version):
    assert unimplemented_hooks(source_of(version)) == []


def test_the_init_takes_what_each_version_constructs_it_with(version):
    src = source_of(version)
    base = src.methods(CONNECTOR_BASE, "KVConnectorBase_V1")["__init__"]
    assert base.positional[:3] == ("vllm_config", "role", "kv_cache_config"), base
    assert own_methods(CONNECTOR, "PdcConnector")["__init__"].positional == base.positional[:3]


def broken_copy(tmp_path: Path, version: str, edit) -> Source:
    """This version's source with its connector base edited: a copy, the cache untouched."""
    src = source_of(version)
    root = tmp_path / "vllm-broken"
    rel = Path(*CONNECTOR_BASE.split(".")).with_suffix(".py")
    (root / rel).parent.mkdir(parents=True)
    for module in ("vllm.v1.core.sched.output", "vllm.v1.outputs"):
        path = src.module_file(module)
        (root / path.relative_to(src.root)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / path.relative_to(src.root))
    (root / rel).write_text(edit((src.root / rel).read_text()))
    return Source(root)


def test_the_checks_fail_when_a_hook_the_connector_uses_is_removed_from_the_base(tmp_path):
    src = broken_copy(tmp_path, "0.32.0", lambda text: text.replace(
        "def get_block_ids_with_load_errors(self)", "def _renamed_get_block_ids_with_load_errors(self)"))
    assert f"{CONNECTOR_BASE}.KVConnectorBase_V1.get_block_ids_with_load_errors" in missing_symbols(src, "0.32.0")


def test_the_checks_fail_when_a_version_adds_an_abstract_hook(tmp_path):
    marker = "    @abstractmethod\n    def start_load_kv("
    src = broken_copy(tmp_path, "0.32.0", lambda text: text.replace(
        marker, "    @abstractmethod\n    def new_required_hook(self, request) -> None: ...\n\n" + marker))
    assert unimplemented_hooks(src) == ["PdcConnector does not implement KVConnectorBase_V1.new_required_hook"]


def test_the_checks_fail_when_a_hook_changes_its_parameters(tmp_path):
    src = broken_copy(tmp_path, "0.32.0", lambda text: text.replace(
        "def wait_for_layer_load(self, layer_name: str)", "def wait_for_layer_load(self, layer_name: str, stream)"))
    assert unimplemented_hooks(src) == [
        "PdcConnector.wait_for_layer_load vs KVConnectorBase_V1.wait_for_layer_load: missing parameter 'stream'"]


def test_a_version_outside_the_set_is_refused_naming_it_and_the_set():
    from pdcluster.transfer.vllm_compat import UnsupportedVllm

    with pytest.raises(UnsupportedVllm, match=r"vLLM 0\.31\.0 is installed; pdcluster supports vLLM 0\.23\.0, "
                                              r"0\.26\.0, 0\.32\.0, 0\.33\.0, 0\.34\.0"):
        check_supported("0.31.0")
    assert check_supported("0.33.0").sleep_mode_hook


# ---------------------------------------------------------------- the patches, per version

from pdcluster.cluster import vllm_patches  # noqa: E402
from pdcluster.cluster.vllm_patches import ENV_VERSIONS, PATCH_SET_ENV  # noqa: E402

PATCHES = [(set_name, patch) for set_name, patches in vllm_patches._PATCH_SETS.items() for patch in patches]
# Where a patch's name is not installed, why, as the source shows it: (module, text it holds).
NOT_NEEDED = {
    ("promote_drops_bounded_replay", "0.34.0"): ("vllm.v1.core.kv_cache_planning",
                                                 'drop=("extra_retained_tokens", "bounded_replay")'),
}
DSV4_MODEL = "vllm.models.deepseek_v4.cpu.cpu_mla"  # the dsv4_cpu set: versions without the model need none


def patch_problems(src: Source, patch, version: str) -> list[str]:
    out = []
    module = patch.source_module
    if module is None:
        return out
    if src.module_file(module) is None:
        return [f"{patch.name}: no module {module} in vLLM {version}"]
    if patch.target and src.defines(patch.module, patch.target) is None:
        out.append(f"{patch.name}: {patch.module}.{patch.target} is not in vLLM {version}")
    if patch.source_text and patch.source_text not in src.module_file(module).read_text():
        out.append(f"{patch.name}: {module} no longer holds {patch.source_text!r} in vLLM {version}")
    return out


@pytest.mark.parametrize("set_name,patch", PATCHES, ids=[f"{s}-{p.name}-{'-'.join(p.versions)}" for s, p in PATCHES])
def test_each_patch_finds_what_it_replaces_in_each_version_it_applies_to(set_name, patch):
    assert set(patch.versions) <= set(SUPPORTED), f"{patch.name}: versions outside the supported set"
    problems = [p for v in patch.versions for p in patch_problems(source_of(v), patch, v)]
    assert problems == []


def test_each_patch_is_installed_or_not_needed_on_every_version():
    """A patch name missing for a version is fixed there upstream (NOT_NEEDED) or, for DeepSeek-V4's
    set, the version has no DeepSeek-V4 at all; no version gets a patch twice."""
    for set_name, patches in vllm_patches._PATCH_SETS.items():
        for name in {p.name for p in patches}:
            for version in SUPPORTED:
                count = sum(version in p.versions for p in patches if p.name == name)
                assert count <= 1, f"{name} installed {count} times on {version}"
                if count:
                    continue
                src = source_of(version)
                if (name, version) in NOT_NEEDED:
                    module, text = NOT_NEEDED[name, version]
                    assert text in src.module_file(module).read_text(), f"{name}: {version} does not have the fix"
                else:
                    assert set_name == "dsv4_cpu" and src.module_file(DSV4_MODEL) is None, (
                        f"{name} is not installed on vLLM {version}, and nothing says why")


def test_the_env_vars_a_set_sets_exist_in_each_version_they_are_set_for(version):
    envs = (source_of(version).module_file("vllm.envs")).read_text()
    for env in PATCH_SET_ENV.values():
        for name in env:
            if name.startswith("VLLM_"):
                assert (f'"{name}"' in envs) == (version in ENV_VERSIONS.get(name, SUPPORTED)), (name, version)


# ---------------------------------------------------------------- the engine args, per version

ARG_CLASSES = {"engine": ("vllm.engine.arg_utils", "EngineArgs"),
               "kv_transfer_config": ("vllm.config.kv_transfer", "KVTransferConfig"),
               "kv_events_config": ("vllm.config.kv_events", "KVEventsConfig")}


def planned_args() -> dict[str, set[str]]:
    """The keys every engine the project starts passes to vLLM (both roles, our connector and NIXL)."""
    from test_engine_plan import spec

    from pdcluster.cluster.instance_plan import plan_instance

    keys: dict[str, set[str]] = {k: set() for k in ARG_CLASSES}
    for s in (spec(), spec(transfer={"connector": "nixl", "base_port": 19000}),
              spec(engine={"seed": 1, "gpu_memory_utilization": 0.5})):
        for role, index in (("prefill", 0), ("decode", 0)):
            args = dict(plan_instance(s, role, index).engine_args)
            keys["kv_transfer_config"] |= set(args.pop("kv_transfer_config"))
            keys["kv_events_config"] |= set(args.pop("kv_events_config"))
            keys["engine"] |= set(args)
    return keys


def test_every_engine_arg_the_project_passes_is_a_field_in_each_version(version):
    src = source_of(version)
    missing = [f"{cls}.{key}" for what, (module, cls) in ARG_CLASSES.items() for key in sorted(planned_args()[what])
               if src.defines(module, f"{cls}.{key}") is None]
    assert missing == []


def test_the_env_vars_engines_get_exist_in_each_version(version):
    envs = source_of(version).module_file("vllm.envs").read_text()
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        assert f'"{name}"' in envs, f"{name} is not in vLLM {version}'s envs.py"
