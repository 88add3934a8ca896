"""`actorserve fleet`: N replicas behind sglang-router, one URL (`supervisor` runs the processes,
`front` is the URL and takes the control routes the router does not, `fleet_cli` the command)."""
