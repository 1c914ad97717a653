"""The scan's way to a run's grid and back: resampling on the devices, canvases, a
region's window, the way back to the scan's voxels, post-processing."""
