"""Phase decomposition, indicators, knee detection, SLOs (see the issues on analytics)."""
