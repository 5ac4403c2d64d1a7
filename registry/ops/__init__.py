"""Operations that compose the store and the catalog; import catalog, fs, format and the base modules only."""
