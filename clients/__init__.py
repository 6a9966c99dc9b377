"""The Flower ClientApp side of fl_split (one app; the party's role comes from the node config)."""
