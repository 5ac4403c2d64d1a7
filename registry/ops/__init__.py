"""Operations that compose the store and the catalog; import catalog, fs, format, the retention policies and
the base modules only."""
