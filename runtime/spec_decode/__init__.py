"""Speculative decoding (issue 17): a cheap proposer guesses up to k tokens per request, the
target model scores them in one pass, and rejection sampling keeps what the target would have
sampled. Device-free pieces only:

    spec_config.py        SpeculativeConfig: vLLM's `speculative_config` names and validation
    ngram_proposer.py     prompt lookup: the tokens that followed the last n-gram's latest match
    target_probs.py       processed logits -> the probabilities the plain sampler draws from
    rejection_sampler.py  accept / resample / bonus over a batch, seeded per request
"""
