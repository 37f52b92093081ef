"""Speculative decoding: prompt-lookup drafting and the rejection sampler that verifies a draft
against the target model's logits."""
