"""Cluster mode: many machines, one endpoint, on Ray (`corral serve --ray auto`).

`entry` is the entry process (membership, books, routing, the HTTP relay), `agent` the Ray
actor on each node that runs the node's own corral, `node` that corral's main, `placement`
the pure choice of a node. Only cluster mode imports Ray (an optional extra: corral[ray]).
"""
