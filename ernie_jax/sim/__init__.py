"""The PD simulator: the engine's scheduler, page pools, instance step boundary and PD policy run in
virtual time against a cost model (simulator.py), on synthetic traces (traces.py), with an 8xH200 roofline
cost model (cost.py). `python -m ernie_jax.sim`.
"""
