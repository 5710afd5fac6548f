"""One generate call's decoding loop and what it needs: rows, scoring, inputs, settings, stats, sampling."""
