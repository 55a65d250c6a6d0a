"""Deployment: a medpfl method run across real sites with Flower (``docs/deployment.md``).

The server side (:mod:`medpfl.deploy.server`) runs the simulator's engine with a client side
that reaches the sites through Flower; each site (:mod:`medpfl.deploy.site`) runs the method's
client hooks on its own data with the sequential executor and keeps its client state on its
own disk. :mod:`medpfl.deploy.app` holds the Flower ServerApp and ClientApp.
"""
