from tests.dataplane.helpers import make_header, server, store

__all__ = ["make_header", "server", "store"]
