import sys
from pathlib import Path

# tests/validator.py is shared by test modules in several folders
sys.path.insert(0, str(Path(__file__).parent))
