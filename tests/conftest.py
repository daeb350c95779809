

def pytest_collection_modifyitems(config, items):
    # End-to-end modules run after the unit tests: a unit failure shows in seconds.
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)
