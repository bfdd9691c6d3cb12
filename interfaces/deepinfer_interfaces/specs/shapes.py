"""DeepSeek V4-Flash's per-op shapes, for the op specs' real-shape cases (at small token counts)."""

#: attention: query heads, head dim (K=V rows), rope channels, sliding window
HEADS, HEAD_DIM, ROPE_DIM, WINDOW = 64, 512, 64, 128
#: lightning indexer: heads, head dim, entries kept per token
INDEX_HEADS, INDEX_HEAD_DIM, INDEX_TOPK = 64, 128, 512
#: residual streams (hc_mult) and hidden size
HC_MULT, HIDDEN = 4, 4096
#: routed experts, experts per token, expert intermediate size, routed scaling
EXPERTS, TOP_K, MOE_INTER, ROUTED_SCALING = 256, 6, 2048, 1.5
#: vocabulary
VOCAB = 129280
#: compressor windows: the heavily compressed attention's (one window, head_dim channels) and the
#: compressed sparse attention's (overlapping windows, two series of head_dim channels)
HCA_RATIO, CSA_RATIO = 128, 4
