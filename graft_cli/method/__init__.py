"""A method and its drafter in one configuration object, checked before the model loads (``config``), and built
into the proposer the decoding loop drives (``builder``)."""
