"""The components: every module here holds parameters only and takes plain keyword arguments
(src/attnlab/build.py translates a config into them).

    attention/   the attention layer, its kernels, mask descriptions
    positional/  one file per positional scheme, and RoPE's scalings
    ffn/         dense, gated (GLU) and mixture-of-experts feed-forward networks
    activations.py, norms.py, block.py (residual wiring), stack.py (one encoder or decoder),
    heads.py, model.py (the three architectures), init.py, inputs.py (checks at the edge)
"""
