# ruff: noqa: F821  (a lab cell: the name comes from the notebook's import cell)
# math comes from the notebook's first code cell.
def merge_partitions(max_logits, exp_sums, outputs):
    top = max(max_logits)
    w = [s * math.exp(m - top) for m, s in zip(max_logits, exp_sums)]
    return [sum(wi * o[d] for wi, o in zip(w, outputs)) / sum(w) for d in range(len(outputs[0]))]
