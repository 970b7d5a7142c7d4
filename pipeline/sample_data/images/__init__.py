"""Sample pictures (scikit-image test images, BSD) shipped as package data."""
