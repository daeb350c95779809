import pytest
from dispatch_fakes import cancelled  # noqa: F401  (a fixture of the dispatcher's unit tests)
from kv_event_fakes import engine, ports  # noqa: F401  (fixtures of the KV-event feed's tests)
from lab_agents import agents  # noqa: F401  (the lab's end-to-end tests)
from router_fakes import fake_router, tok, tok_dir  # noqa: F401  (fixtures of the router's unit tests)
from transfer_fakes import gloo_pair, make_d, make_p, stub_to  # noqa: F401  (fixtures of the transfer's unit tests)


def _shared(item, what: str = "shared_cluster") -> str | None:
    marker = item.get_closest_marker(what)
    return marker.args[0] if marker else None


def _local_ray(item) -> bool:
    return item.get_closest_marker("local_ray") is not None


def pytest_collection_modifyitems(config, items):
    # End-to-end modules run after the unit tests: a unit failure shows in seconds. Those on the
    # session's local Ray (e2e.local_ray) run one after another, before the rest. Modules that
    # share a cluster (e2e.shared_cluster) or a lab (e2e.shared_lab) run one after another, where
    # the first of them stands.
    def group(item) -> str:  # the shared cluster's or lab's name, else the module
        return _shared(item) or _shared(item, "shared_lab") or item.nodeid.split("::")[0]

    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(group(item), i)
    items.sort(key=lambda item: (item.get_closest_marker("e2e") is not None, not _local_ray(item), first[group(item)]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # After the last test of the last module sharing a cluster (its module fixtures are gone
    # by now): stop the cluster; sharing a lab: take the lab down; after the last on the local
    # Ray: stop that Ray.
    try:
        return (yield)
    finally:
        name = _shared(item)
        if name is not None and (nextitem is None or _shared(nextitem) != name):
            from e2e import stop_shared_cluster

            stop_shared_cluster(name)
        lab = _shared(item, "shared_lab")
        if lab is not None and (nextitem is None or _shared(nextitem, "shared_lab") != lab):
            from e2e import stop_shared_lab

            stop_shared_lab(lab)
        if _local_ray(item) and (nextitem is None or not _local_ray(nextitem)):
            from e2e import stop_local_ray

            stop_local_ray()
