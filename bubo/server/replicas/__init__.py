"""Replicas behind Ray Serve (`bubo serve --replicas N`, or a Ray Serve config file): an ingress
deployment takes HTTP and hands each request to one replica deployment, each replica a whole Bubo
server on a loopback port of its own. Needs the `serve` extra (`pip install 'bubo[serve]'`)."""
