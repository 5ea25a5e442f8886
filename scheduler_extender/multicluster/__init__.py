"""Many clusters: the hub's Cluster objects, the member agent, the hub controller and join/leave."""
