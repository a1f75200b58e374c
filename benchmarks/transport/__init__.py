"""Files to and from a lent GPU machine, in checked pieces (benchmarks/transport/README.md): no measurement here."""
