"""A Generator's structured output: the request's grammar from its arguments, checked against the model's
tokenizer before any forward, and the constraint a generation runs under."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from graft_cli.core import Clock, GraftError
from graft_cli.grammar import Grammar, GrammarConstraint, GrammarTokenizer, json_schema as schema_grammar
from graft_cli.grammar import regex as regex_grammar


class Grammars:
    """Grammars for one loaded model. The tokenizer llguidance reads is built on the first structured request
    (about a second for a large vocabulary), never for a Generator that has none. ``drafts``: whether forced
    tokens are drafted (not for plain decoding, the reference a grammar's speed-up is measured against)."""

    def __init__(self, tokenizer: Any, vocab: int, stops: Iterable[int], drafts: bool) -> None:
        self.tokenizer, self.vocab, self.stops, self.drafts = tokenizer, vocab, set(stops), drafts
        self._compiled: GrammarTokenizer | None = None

    @property
    def compiled(self) -> GrammarTokenizer:
        if self._compiled is None:
            self._compiled = GrammarTokenizer(self.tokenizer, self.vocab, self.stops)
        return self._compiled

    def checked(self, json_schema: dict | str | None = None, regex: str | None = None,
                grammar: Grammar | None = None) -> Grammar | None:
        """The one grammar a request's arguments give (None: free text), compiled once to check it."""
        given = [x for x in (json_schema, regex, grammar) if x is not None]
        if len(given) > 1:
            raise GraftError("give one of json_schema, regex and grammar")
        if not given:
            return None
        made = schema_grammar(json_schema) if json_schema is not None else regex_grammar(regex) if regex is not None \
            else grammar
        self.compiled.check(made)
        return made

    def constraint(self, grammar: Grammar | None, clock: Clock, prompt: Sequence[int] = ()) -> GrammarConstraint | None:
        """A generation's grammar state (None for free text), its host time read on ``clock`` (the proposer's
        recorder's, as every phase of the generation); ``prompt``, whose text copied values are drafted from."""
        return None if grammar is None else GrammarConstraint(grammar, self.compiled, clock, self.drafts, prompt)
