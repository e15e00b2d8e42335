"""What every plugin stands on: the explicit registries it joins and the strict numbers of typed configs."""
