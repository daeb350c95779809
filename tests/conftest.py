from dispatch_fakes import cancelled  # noqa: F401  (a fixture of the dispatcher's unit tests)
from kv_event_fakes import engine, ports  # noqa: F401  (fixtures of the KV-event feed's tests)
from lab_agents import agents  # noqa: F401  (the lab's end-to-end tests)
from router_fakes import fake_router, tok, tok_dir  # noqa: F401  (fixtures of the router's unit tests)
from transfer_fakes import gloo_pair, make_d, make_p, stub_to  # noqa: F401  (fixtures of the transfer's unit tests)


def pytest_collection_modifyitems(config, items):
    # End-to-end modules run after the unit tests: a unit failure shows in seconds.
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)
