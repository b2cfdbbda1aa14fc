"""Parallelism as composable transforms: mesh, collectives, tensor/sequence parallel, sharding."""
