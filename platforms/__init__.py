"""edgekv.platforms: hardware adapters (devices, disks, power meters) implementing the runtime interfaces."""
