"""Generated gRPC modules (``make proto``); committed, checked by tests/unit/test_proto.py."""
