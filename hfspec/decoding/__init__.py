"""One generate call's decoding loop (``loop``) and what it needs: its rows, the scoring of logits, the prompts'
inputs, the generation config, the stats, and the sampling math."""
