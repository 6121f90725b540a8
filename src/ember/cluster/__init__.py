"""Ember on Ray Serve: the same two roles as `ember serve --workers N`, as deployments.

- `engine.EmberEngine`: each replica holds a `Registry` (models and their workers) on its
  device, takes prepared items and batches them by Ember's own rules. Model multiplexing
  routes a model's requests to the replicas that hold it; the registry is the cache.
- `ingress.EmberIngress`: the HTTP API of `ember serve` (`create_app`) over the engine
  replicas (`client.RayEngineClient` behind the `RemoteModels` of the API processes).
- `app`: the two applications (engine, then ingress: a drain stops them in the other
  order), for `ember serve --ray` (`run.serve_on_ray`) and for Serve config files.

Importing this package imports Ray: only `ember serve --ray` and Ray itself do.
"""
