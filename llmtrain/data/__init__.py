"""The data pipeline, in the order a row travels: sources.py loads a source (a local
file through llmtrain/files.py, which keeps each row's line) and tells its format, rows.py
turns one row into token ids and shifted labels (answers.py a prompt and its answers),
prepare.py tokenizes a whole split of any kind (kind.py: what a kind's rows become) into the
cache, mixture.py holds out and mixes sources, packing.py packs rows, stream.py does it all
as a stream is read, batches.py orders and collates, and build.py is the one builder every
recipe's data sets come from."""
