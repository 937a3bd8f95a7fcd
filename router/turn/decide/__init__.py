"""The turn's decision core: one pure module per question the turn asks, each returning its
answer as data (docs/architecture.md, *Modules*). The turn's steps and the legs apply them."""
