"""Training the embedded model with the project's own code: corpus, tokenizer, optax training, release.

corpus.py (python -m ernie_jax.train.corpus) fetches and splits the text; vocab.py trains the tokenizer;
data.py turns splits into token streams and per-step batches; step.py is the loss and optimizer step;
recipes.py names model and training settings; run.py (python -m ernie_jax.train) is the resumable run;
evaluate.py (python -m ernie_jax.train.evaluate) measures perplexity and MTP accuracy; release.py
(python -m ernie_jax.train.release) writes a run's checkpoint as the FP8-Paddle model folder.
"""
