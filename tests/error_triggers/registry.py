"""The registry of triggers: one function per row of docs/errors.md, keyed by the row's id."""

TRIGGERS = {}


def trigger(row_id):
    """Register the function that triggers row ``row_id`` of docs/errors.md."""

    def register(fn):
        assert row_id not in TRIGGERS, row_id
        TRIGGERS[row_id] = fn
        return fn

    return register
