"""``--replicas N``: engine replicas behind Ray Serve (deploy.py), the request router (router.py) and what they
exchange without Ray (forwarding.py). Importing this package imports no Ray; deploy.py and router.py do."""
