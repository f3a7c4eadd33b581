"""Inter-stage fusion (generation -> inference, RLHFuse section 4.2).

`policy` (pure): when to migrate the long tail (threshold R, chosen by
simulating generation + inference), how many destinations (m) and which.
`transport`: moving one unfinished sample (`MigratedSequence`) between ranks
in a fixed, versioned message layout. `runtime`: the generation side at run
time (count unfinished samples every k steps, migrate once below R, then
`finish_tail`). `stream`: the destinations' finished samples to the freed
ranks. `inter_stage`: the trainer's side (``--inter-stage-fusion``): R and
K/V choices, inference on the freed ranks, metrics. The engine stays unaware
of fusion: it only exports and imports sequences. See docs/fusion.md.
"""
