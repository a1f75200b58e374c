"""The datastore package's one user-facing exception (the CLI and the plugins turn it into ``GraftError``)."""


class DatastoreError(Exception):
    """A problem with a corpus or a store that the user can fix: the message is one line, fit to print as is."""
